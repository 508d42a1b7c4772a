# duplex in a container: `make install` (CPU torch unless a GPU is visible) and the server on
# port 8000 of every interface. WebRTC and RTP media use ports ICE and SDP pick at run time, so run
# it with host networking (compose.yaml) rather than a published port.
# Not built on the development machines (they reach no container registry): kept minimal.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN make install
EXPOSE 8000
ENTRYPOINT ["python", "-m", "duplex.serve", "--host", "0.0.0.0"]
