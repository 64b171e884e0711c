"""GPU probes: NVML, nvidia-smi, and the simulated GPU, behind one port."""
