"""Out-of-memory recovery: a guarded forward that makes room one rung at a time and runs again, and what each call
shape's activations were learnt to need. Its modules are imported by name (this file imports nothing)."""
