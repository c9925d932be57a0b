#!/bin/sh
# The postgres image's start: on the first start (no $PGDATA/PG_VERSION) initdb with POSTGRES_USER as
# superuser and POSTGRES_PASSWORD as its password, then POSTGRES_DB; then the server, with the
# arguments given (`-c name=value`). Local socket: trust; TCP: scram-sha-256, as that image does.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" -E UTF8 --auth-local=trust --auth-host=scram-sha-256
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then  # on a server that listens on its socket only, as that image does
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
        psql -v ON_ERROR_STOP=1 -U "$user" -d postgres -c "CREATE DATABASE \"$db\" OWNER \"$user\""
        pg_ctl -D "$PGDATA" -m fast -w stop
    fi
fi
exec postgres -D "$PGDATA" "$@"
