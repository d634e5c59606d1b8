"""Alembic environment: the engine comes from fleet's own ``Database``."""

from alembic import context

from fleet.store.schema import metadata

config = context.config
engine = config.attributes.get("engine")
if engine is None:  # plain `alembic` command line: build one from the URL given
    from sqlalchemy import create_engine

    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")

with engine.begin() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        version_table="fleet_alembic_version",
    )
    context.run_migrations()
