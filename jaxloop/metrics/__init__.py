"""Where a loop's metrics go: writers (TensorBoard, CSV, JSON lines, trackers), the
in-memory history, the progress bar and notebook logging."""
