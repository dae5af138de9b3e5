"""A tiny Tk form the GUI tests drive inside a workspace: an entry, a Submit button and a result label. Once drawn
it writes ``ready.json`` (screen coordinates of the entry's and the button's centres); Submit (or Return in the
entry) shows the answer and writes it to ``answer.txt``. The insertion cursor does not blink, so a screen that
nobody touches stays pixel-for-pixel the same."""

import json
import sys
import tkinter as tk

out = sys.argv[1] if len(sys.argv) > 1 else "/workspace"
root = tk.Tk()
root.title("bunshin form")
root.geometry("420x160+40+40")
tk.Label(root, text="Your answer:").pack(pady=4)
entry = tk.Entry(root, width=32, insertofftime=0)
entry.pack()
result = tk.Label(root, text="(no answer yet)")


def submit(event: object = None) -> None:
    result.config(text="You typed: " + entry.get())
    with open(f"{out}/answer.txt", "w") as f:
        f.write(entry.get())


button = tk.Button(root, text="Submit", command=submit)
button.pack(pady=4)
result.pack()
entry.bind("<Return>", submit)


def ready() -> None:
    root.update_idletasks()

    def centre(w: tk.Widget) -> list[int]:
        return [w.winfo_rootx() + w.winfo_width() // 2, w.winfo_rooty() + w.winfo_height() // 2]

    with open(f"{out}/ready.json.tmp", "w") as f:
        json.dump({"entry": centre(entry), "button": centre(button)}, f)
    import os

    os.rename(f"{out}/ready.json.tmp", f"{out}/ready.json")


root.after(200, ready)
root.mainloop()
