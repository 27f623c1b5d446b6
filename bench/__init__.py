
import os

# Benchmarks run several agents at once: each serves its kubelet API on a free port
# (its Node's daemonEndpoints say which) rather than all on 10250.
os.environ.setdefault("NODEPULSE_PORT", "0")
