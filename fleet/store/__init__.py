"""The store: schema, connection, the one writer (``ledger``) and the readers (``queries``)."""
