"""nn.Module -> one flat fx.GraphModule (torch.fx or torch.export), and the checks for
what a graph would silently lose."""
