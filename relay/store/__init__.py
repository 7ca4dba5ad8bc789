"""The store: runs, deliveries and replicas in SQL, one schema for SQLite and PostgreSQL.

The Store and its transactions (database.py), the tables and their migrations (schema.py),
a run and a delivery as typed records (records.py), admission limits decided in the
inserting transaction (limits.py), delivery rows (deliveries.py), the database URLs the
relay accepts (connection.py), retention of old runs (retention.py); sqlite/ holds what
only SQLite needs. It imports nothing of the relay but errors: it knows nothing of
providers, tokens, runs' logic or HTTP.
"""
