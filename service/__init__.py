"""The application layer, grouped by side (dependencies flow client -> api <- server -> core -> job):

- `job`: the compression job itself (`service.job.compress`): request schema, model kinds, targeting,
  report.json / report.html; what `osscar compress` runs locally and a server's worker runs;
- `core`: the server's transport-agnostic job service (queue, workers, durable store, outcomes) and what
  it stands on: content-addressed blobs, reference resolution and policy, metrics;
- `server`: the gRPC layer over the core (`app`: life cycle; `interceptors`: auth and the error mapping;
  `servicers`; `settings`);
- `client`: the `osscar` command line (`cli`), its flags (`options`), the connection to a server
  (`transport`), remote jobs and operations, the terminal, `osscar demo`;
- `api`: the wire contract both sides speak (generated protobuf, `wire`: protobuf <-> domain objects);
- shared: `errors` (domain errors), `files`, `logs`, `embedded` (the embedded model and calibration text).
"""
