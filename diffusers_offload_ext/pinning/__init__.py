"""Page-locking and the copy stream: host memory registered with the driver in place, within a host budget, so that
copies run from page-locked memory, and prefetches on a CUDA copy stream overlap compute. Its modules are imported by
name (this file imports nothing)."""
