;;; canvas-ls.el --- canvas-ls with eglot or lsp-mode  -*- lexical-binding: t; -*-
;; Both clients get canvas-ls's suggestion through textDocument/completion (completion-at-point, company,
;; corfu). Inline (ghost-text) completion through LSP has not been verified with either client.

;;; eglot (built into Emacs 29+)
(with-eval-after-load 'eglot
  (add-to-list 'eglot-server-programs
               '((python-mode python-ts-mode go-mode go-ts-mode js-mode js-ts-mode typescript-ts-mode
                  rust-mode rust-ts-mode c-mode c-ts-mode c++-mode c++-ts-mode java-mode lua-mode)
                 . ("canvas-ls" "serve" :initializationOptions (:engine (:device "auto"))))))

;;; lsp-mode
(with-eval-after-load 'lsp-mode
  (lsp-register-client
   (make-lsp-client
    :new-connection (lsp-stdio-connection '("canvas-ls" "serve"))
    :activation-fn (lsp-activate-on "python" "go" "javascript" "typescript" "rust" "c" "cpp" "java" "lua")
    :initialization-options (lambda () '(:engine (:device "auto")))
    :add-on? t  ; alongside your language's own server
    :server-id 'canvas-ls)))

(provide 'canvas-ls)
;;; canvas-ls.el ends here
