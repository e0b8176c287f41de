"""Tables bigger than memory: hot rows in memory, cold rows on local disk (RocksDB), and the PS's budget."""
