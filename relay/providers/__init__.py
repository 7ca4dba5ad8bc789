"""Sandbox providers behind one contract (see ``base.py``)."""
