SUFFIX = "!"
