"""Framework-free core: level schemes, distributions, statistics, adaptation, reference codec."""
