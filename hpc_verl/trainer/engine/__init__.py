"""A rank's compute: device and threads, log-probs, DDP/FSDP2, sharded state, Ulysses
sequence parallelism, the pre-allocated KV cache, the CPU GEMM and phase timing.

Runs in the rank processes (Ray workers). torch may be imported at a module's top here
(cpu_gemm does); the others import it in functions so that roles/nodes stays torch-free.
"""
