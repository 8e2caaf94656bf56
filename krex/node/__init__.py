"""The node side: krexd (daemon.py, built in layers: state.py the shared state and the
handler table, slots.py, loops.py, regionchecks.py, region.py the region protocol,
regions.py the queues and GPU workers, admission.py, server.py) and its parts: the
shared segment (shm.py), the freezer and its /proc and mountinfo helpers, the CPU
partition, the journal, the watchdog, the freeze policies, the segment guard,
attestation, the daemon's settings, and the operator's pause/resume of a GPU's gate.
Nothing here imports the process side (krex.proc), the benchmark (krex.bench) or the
CLI (tests/unit/test_layout.py)."""
