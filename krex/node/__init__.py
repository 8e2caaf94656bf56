"""The node side: krexd (daemon.py: the server, its handler table, slots, admission and
the region protocol) and its parts: the shared segment (shm.py), the freezer and its
/proc and mountinfo helpers, the CPU partition, the journal, the watchdog, the freeze
policies, the segment guard, attestation, the daemon's settings, and the operator's
pause/resume of a GPU's gate. Nothing here imports the process side (krex.proc), the
benchmark (krex.bench) or the CLI (tests/unit/test_layout.py)."""
