"""The client side: the `osscar` command line (`cli`), its flags (`options`), the connection to a
server (`transport`), remote jobs and operations (`remote`, `operations`), the terminal, and `osscar demo`."""
