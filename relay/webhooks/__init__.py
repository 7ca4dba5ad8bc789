"""Signed webhooks: the dispatcher POSTs a finished run to its ``callback_url``, signed, and
retries with backoff until it lands (dispatcher.py).

It listens on the run event bus, builds the body with the run view and claims delivery rows
in the store, so it may import relay.runs, relay.store and the shared settings and errors;
only relay.http, which starts it, imports it. Which callback URLs are safe is a rule of the
run request, checked at submit and again before each attempt: it lives in
relay/runs/callback_urls.py.
"""
