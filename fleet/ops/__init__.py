"""The operator's tools: the CLI, its rendering, metrics and the demo. The top floor:
it acts only through ``fleet.Fleet`` and reads through the store's queries."""
