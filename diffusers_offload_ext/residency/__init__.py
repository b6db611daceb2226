"""The memory budget and residency: which components stay on the device between their uses within a budget (given,
or read from the device less what activations need), and what the exact choice and the forecast behind it are.
Its modules are imported by name (this file imports nothing, so that its pure modules stay free of torch)."""
