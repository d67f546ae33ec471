"""What a run shows: metrics.jsonl, the progress bar, the summary table and plot, and
the experiment trackers (console, file, TensorBoard, W&B, MLflow).

Runs in the driver. No torch at module top (TensorBoard's writer imports it when chosen).
"""
