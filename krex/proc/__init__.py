"""The process side: what runs inside or around a benchmark process. `krex.region()`,
the daemon's client (client.py), the guardian that runs one command in a slot
(launcher.py: `krex run`, and `python -m krex.proc.launcher` for the runner), the
environment that opts a process in, automatic regions for unmodified harnesses (and
the sitecustomize hook that installs them), and the pytest plugin."""
