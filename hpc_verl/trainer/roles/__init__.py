"""What each node of the PPO graph does in a rank: the torch-free node adapters (nodes),
the role workers (actor, critic, reference, reward), mini-batch rules and rule rewards.

Runs in the rank processes. torch may be imported at the top of a role worker's module;
nodes and minibatch stay torch-free at import (the driver declares the graph with them).
"""
