# Postgres for the compose test: Debian's postgresql, in place of the postgres:18-alpine image (no
# registry here), with the same contract: POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB make the
# server's superuser and database on the first start, the data lives under /var/lib/postgresql (the
# volume compose.yaml mounts), pg_isready is on PATH for its health check.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN mkdir -p /etc/postgresql-common \
 && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/postgresql /var/run/postgresql \
 && chown postgres:postgres /var/lib/postgresql /var/run/postgresql
COPY --chmod=0755 postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
USER postgres
ENTRYPOINT ["postgres-entrypoint"]
