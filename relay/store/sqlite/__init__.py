"""What SQLite needs to serve many runs from one file: the group commit (the writes of one
turn of the event loop, and under load of the next two, share one commit), the WAL
checkpointer (checkpoints on a thread of their own, never inside a commit) and the fast
path (the hot statements compiled once and run on the driver). Only the rest of
relay.store imports it; it imports nothing of the relay.
"""
