"""Block streaming: a component larger than the room left runs block by block, its kept blocks on the device and the
others passing through a ring of device buffers. Its modules are imported by name (this file imports nothing, so that
its pure modules stay free of torch)."""
