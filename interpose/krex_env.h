/* What the guardian takes from krexd's admit reply, in ONE place (interpose/guardian_proc.c
 * reads the macro, krex/node/optin.py reads it through krex_daemon_env_names() in
 * krex_core.c, for the unit tests that hold krexd to it).
 *
 * A guardian gives its command only its own installation's code: LD_PRELOAD (the shim),
 * PYTHONPATH (the automatic-region hook) and LD_LIBRARY_PATH (the simulated GPU) are the
 * guardian's own paths whatever krexd answers; of env_set it keeps only the data variables
 * named here, and KREX_DAEMON_CMD only in the one form krexd writes (the shim runs it with
 * /bin/sh): "exec env -u LD_PRELOAD PYTHON -m krex.node.daemon ARGS", where PYTHON is an
 * absolute path in the guardian's own Python's directory and PYTHON and ARGS hold only
 * the characters shlex.join leaves unquoted. krexd's _command_env sends nothing else
 * (tests/unit/test_optin.py holds it to this list). */
#ifndef KREX_ENV_H
#define KREX_ENV_H

#define KREX_DAEMON_ENV \
    "KREX_SHM KREX_SOCKET KREX_DEVICE KREX_SLOT KREX_GPU KREX_SLOT_GEN CUDA_VISIBLE_DEVICES HIP_VISIBLE_DEVICES " \
    "CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY"
#define KREX_DAEMON_CMD_HEAD "exec env -u LD_PRELOAD "
#define KREX_DAEMON_CMD_MODULE " -m krex.node.daemon"
/* Between the Python and the module where that Python takes it (3.11+): the current
 * directory stays off the module path (krex/pystart.py). */
#define KREX_DAEMON_CMD_SAFE_PATH " -P"
/* The characters shlex.join leaves unquoted ([\w@%+=:,./-] in ASCII). */
#define KREX_SHELL_SAFE "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@%+=:,./-"

#endif
