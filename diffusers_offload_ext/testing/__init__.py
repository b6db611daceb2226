"""Test utilities shipped with the package (importable without diffusers)."""
