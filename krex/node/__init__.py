"""The node daemon's parts (krexd itself is krex/daemon.py): the freezer and its
/proc and mountinfo helpers, the CPU partition, the journal, the watchdog, the
freeze policies, the segment guard, attestation, the daemon's settings, and the
operator's pause/resume of a GPU's gate. Nothing here imports the process side
(krex.proc), the benchmark (krex.bench) or the CLI (tests/unit/test_layout.py)."""
