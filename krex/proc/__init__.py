"""The process side: what runs inside or around a benchmark process. `krex.region()`,
the environment that opts a process in, automatic regions for unmodified harnesses
(and the sitecustomize hook that installs them), and the pytest plugin."""
