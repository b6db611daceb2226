"""Observation: the ledger, traces and their reports. Observers read runtime state and never write it."""
