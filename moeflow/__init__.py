"""moeflow: offloaded Mixture-of-Experts inference with learned expert prefetching."""

__version__ = "0.1.0"
