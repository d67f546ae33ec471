"""From profile + job config to what runs: plan, render, (backends live beside them)."""
