"""Test and demo helpers (the tiny pipelines, the simulated accelerator, recording transfers); the runtime never
imports this package."""
