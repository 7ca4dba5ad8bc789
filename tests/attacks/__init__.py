"""Attacks on a real relay: each test is something a hostile caller tried."""
