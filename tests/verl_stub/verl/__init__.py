"""A stand-in for upstream verl on the SLURM test bed (real verl needs GPUs): see trainer/main_ppo.py."""
