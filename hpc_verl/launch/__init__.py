"""Turning a profile + job config into something that runs: plan, render, backends, registry."""
