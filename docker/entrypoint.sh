#!/bin/sh
# Entry point of the cdc image: runs its arguments (`cdc run ...`, `cdc sink ...`,
# `spark-class ...`) after one fix-up.
#
# Spark's driver (a `cdc sink` container), master and worker advertise SPARK_LOCAL_IP to
# each other, and cdc's own default is 127.0.0.1 (right for a local driver, wrong across
# containers). Unless it is set (host networking: 127.0.0.1), it becomes this container's
# address on its network.
set -e
if [ -z "${SPARK_LOCAL_IP:-}" ]; then
    SPARK_LOCAL_IP=$(hostname -i | cut -d' ' -f1)
    export SPARK_LOCAL_IP
fi
exec "$@"
