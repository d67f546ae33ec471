"""The thin command-line layer: one small module per verb, no logic of its own."""
