"""Model files: the offline check of a model directory, the driver's tokenizer, the tiny
random model of tests and demos, and loading a causal LM in a rank.

Runs in any process (driver, ranks, the launcher's model stage). torch and transformers
only inside functions: the driver and the launcher check models without loading torch.
"""
