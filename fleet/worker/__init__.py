"""What runs inside ``fleet worker``: the Celery tasks, the replay, one step's attempt,
leases, dispatch and the sweeper. Imports the store and the vocabulary; never the
client or the CLI."""
