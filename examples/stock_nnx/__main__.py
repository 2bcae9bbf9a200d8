from examples.stock_nnx.train import main

main()
