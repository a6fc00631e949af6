"""Engine-side core: requests, step plans, scheduling."""
