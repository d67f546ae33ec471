"""Benchmarks that compare hpc_verl with a baseline measured in the same run (see benchlib)."""
