"""Hook names, hook functions, capturing heads, online-softmax head statistics, the QK decomposition and the load-time self-check."""
