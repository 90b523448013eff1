# One image for every sessionlog process: the five services (`sessionlog serve NAME`), the CLI, the demo and the
# scripted provider (`python -m services.gateway.scripted`). compose.yaml and deploy/k8s run it.
#
#   docker build -t sessionlog .
#   docker run --rm -p 8470:8470 -p 8471:8471 sessionlog          # `sessionlog up`: embedded nats-server
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The distribution: pyproject.toml, the README it names, the library and the services. Nothing else goes in
# (.dockerignore keeps tests, benchmarks, caches and any .env out).
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . \
    && useradd --system --uid 10001 --gid 0 --home-dir /data --no-create-home sessionlog \
    && mkdir -p /data \
    && chown 10001:0 /data

# In a container the HTTP listeners (gateway, UI, and /healthz /readyz /metrics, which bind to the gateway
# host) must listen on every interface; the data folder only matters for the embedded server of `sessionlog up`.
ENV SESSIONLOG_GATEWAY_HOST=0.0.0.0 \
    SESSIONLOG_UI_HOST=0.0.0.0 \
    SESSIONLOG_DATA_DIR=/data

USER 10001
VOLUME ["/data"]
EXPOSE 8470 8471 9470

ENTRYPOINT ["sessionlog"]
CMD ["up"]
