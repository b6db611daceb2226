"""The runtime: the call guard and hooks that tell a pipeline's session what happens, the session that asks the policy
and has the transfer move, and the pipeline methods and `install()` that put it all in place."""
