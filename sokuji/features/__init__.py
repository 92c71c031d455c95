"""Online features for pipelines: a real Feast feature store (SQLite online store by default,
Redis when configured) and the built-in ``rag`` pipeline's feature repository.

Importing this package imports nothing heavy: Feast (~4 s to import, with pandas, dask and,
when installed, torch) is imported by ``OnlineFeatures.open`` only.

    store_config.py  FeatureStoreConfig: where the store lives, how its online store is reached
    store.py         OnlineFeatures: open (set up once), get, close
    setup.py         the repository applied and materialized once per data fingerprint
    rag_repo.py      the built-in repository: entity ``user``, feature view ``user_profile``,
                     the generated users (seeded) written as the offline source
    tenant_ids.py    scoped(tenant, id): the row a keyed tenant's id is looked up as
"""
