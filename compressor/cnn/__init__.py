"""Conv graphs (torch.export ATen graphs): `models` (references to graphs, saving programs), `graph`
(which convs are prunable and through which channel-wise ops), `surgery` (physical channel removal),
`segments` (advancing activations segment by segment), `depth` (removing whole residual blocks first)
and `pipeline` (`prune_conv_graph`).
Never imports `compressor.transformer`.
"""
