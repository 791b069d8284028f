"""kvtool's reference emulator: userspace NVMe/TCP target, kernel-target launcher, CPU "GPU" tier."""
