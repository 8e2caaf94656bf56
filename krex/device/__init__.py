"""What the machine's GPU stack is: GPU discovery (NVML, the driver, the simulated
GPU), the NVML layer, and the ELF check for statically linked CUDA runtimes. Used by
the node daemon, the process side, the doctor and the benchmark alike."""

DEVICES = ("auto", "gpu", "sim")  # what --device takes: a real GPU, the simulated one, or either
